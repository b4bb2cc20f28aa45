"""JSON Pointer (RFC 6901) lookups into parsed JSON documents (dicts and lists)."""


class PointerError(KeyError):
    """A pointer that is malformed or does not refer to a value in the document."""


def escape(token):
    """One reference token in pointer form: '~' -> '~0', '/' -> '~1'."""
    return token.replace("~", "~0").replace("/", "~1")


def join_pointer(tokens):
    return "".join("/" + escape(str(token)) for token in tokens)


def split_pointer(pointer):
    """The reference tokens of a pointer: '/a~1b/0' -> ['a/b', '0']; '' -> []."""
    raise NotImplementedError("split_pointer is not implemented yet")


def resolve(doc, pointer):
    """The value `pointer` refers to in `doc`; PointerError if there is none."""
    raise NotImplementedError("resolve is not implemented yet")


def get(doc, pointer, default=None):
    try:
        return resolve(doc, pointer)
    except PointerError:
        return default
