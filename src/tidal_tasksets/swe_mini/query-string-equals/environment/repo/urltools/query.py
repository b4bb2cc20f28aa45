"""Query strings: 'a=1&b=two%20words' <-> {'a': ['1'], 'b': ['two words']}."""

from urllib.parse import quote_plus, unquote_plus


def parse_query(query):
    """{name: [values]} in order of appearance. A leading '?' is ignored, '+' is a
    space and %XX escapes are decoded; a name without '=' gets the value ''; empty
    pieces are skipped."""
    result = {}
    for piece in query.lstrip("?").split("&"):
        if not piece:
            continue
        if "=" in piece:
            name, value = piece.split("=")
        else:
            name, value = piece, ""
        result.setdefault(unquote_plus(name), []).append(unquote_plus(value))
    return result


def first(params, name, default=None):
    values = params.get(name)
    return values[0] if values else default


def build_query(params):
    return "&".join(f"{quote_plus(name)}={quote_plus(value)}"
                    for name, values in params.items() for value in values)
