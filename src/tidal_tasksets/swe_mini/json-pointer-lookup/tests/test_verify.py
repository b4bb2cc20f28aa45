import unittest

from confdoc.pointer import PointerError, escape, get, join_pointer, resolve, split_pointer

DOC = {
    "database": {"replicas": [{"host": "db1"}, {"host": "db2"}], "port": 5432},
    "a/b": 1,
    "m~n": 2,
    "": "empty key",
    "flags": [],
    "nothing": None,
}


class VerifyPointer(unittest.TestCase):
    def test_escape_and_join(self):
        self.assertEqual(escape("a~/b"), "a~0~1b")
        self.assertEqual(join_pointer(["a/b", "c~d", 0]), "/a~1b/c~0d/0")

    def test_split(self):
        self.assertEqual(split_pointer("/a~1b/c~0d"), ["a/b", "c~d"])
        self.assertEqual(split_pointer("/database/replicas/0"), ["database", "replicas", "0"])

    def test_split_edge_cases(self):
        self.assertEqual(split_pointer(""), [])
        self.assertEqual(split_pointer("/"), [""])
        self.assertEqual(split_pointer("/~01"), ["~1"])
        self.assertEqual(split_pointer("/a//b"), ["a", "", "b"])

    def test_split_requires_leading_slash(self):
        with self.assertRaises(PointerError):
            split_pointer("database/port")

    def test_resolve_dicts_and_lists(self):
        self.assertEqual(resolve(DOC, "/database/replicas/1/host"), "db2")
        self.assertEqual(resolve(DOC, "/database/port"), 5432)
        self.assertIsNone(resolve(DOC, "/nothing"))

    def test_resolve_whole_document_and_escapes(self):
        self.assertIs(resolve(DOC, ""), DOC)
        self.assertEqual((resolve(DOC, "/a~1b"), resolve(DOC, "/m~0n")), (1, 2))
        self.assertEqual(resolve(DOC, "/"), "empty key")

    def test_missing_key(self):
        with self.assertRaises(PointerError):
            resolve(DOC, "/database/user")
        with self.assertRaises(KeyError):
            resolve(DOC, "/nope")

    def test_bad_list_indices(self):
        for pointer in ("/database/replicas/2", "/database/replicas/01",
                        "/database/replicas/-1", "/database/replicas/x", "/flags/0"):
            with self.assertRaises(PointerError, msg=pointer):
                resolve(DOC, pointer)

    def test_descending_into_scalars(self):
        with self.assertRaises(PointerError):
            resolve(DOC, "/database/port/0")
        with self.assertRaises(PointerError):
            resolve(DOC, "/nothing/x")

    def test_error_mentions_pointer(self):
        try:
            resolve(DOC, "/database/replicas/7/host")
        except PointerError as e:
            self.assertIn("/database/replicas/7/host", str(e))
        else:
            self.fail("no PointerError")

    def test_get(self):
        self.assertEqual(get(DOC, "/database/replicas/0/host"), "db1")
        self.assertEqual(get(DOC, "/database/user", "postgres"), "postgres")


if __name__ == "__main__":
    unittest.main()
