import unittest

from urltools.query import build_query, first, parse_query


class VerifyQuery(unittest.TestCase):
    def test_simple(self):
        self.assertEqual(parse_query("a=1&b=two+words"), {"a": ["1"], "b": ["two words"]})

    def test_repeated_names(self):
        self.assertEqual(parse_query("tag=x&tag=y&q=1"), {"tag": ["x", "y"], "q": ["1"]})

    def test_percent_escapes(self):
        self.assertEqual(parse_query("?city=S%C3%A3o%20Paulo&x=%2B1"),
                         {"city": ["São Paulo"], "x": ["+1"]})

    def test_value_with_equals(self):
        self.assertEqual(parse_query("user=ada&token=YWJjZA=="),
                         {"user": ["ada"], "token": ["YWJjZA=="]})

    def test_redirect_url_value(self):
        self.assertEqual(parse_query("next=/search?q=1&page=2"),
                         {"next": ["/search?q=1"], "page": ["2"]})

    def test_empty_value_with_equals(self):
        self.assertEqual(parse_query("a=&b=="), {"a": [""], "b": ["="]})

    def test_flags_and_empty_pieces(self):
        self.assertEqual(parse_query("debug&&a=1&"), {"debug": [""], "a": ["1"]})
        self.assertEqual(parse_query(""), {})

    def test_first(self):
        params = parse_query("a=1&a=2")
        self.assertEqual(first(params, "a"), "1")
        self.assertEqual(first(params, "b", "none"), "none")

    def test_round_trip(self):
        params = {"q": ["a b", "c&d"], "eq": ["x=y"]}
        self.assertEqual(parse_query(build_query(params)), params)


if __name__ == "__main__":
    unittest.main()
