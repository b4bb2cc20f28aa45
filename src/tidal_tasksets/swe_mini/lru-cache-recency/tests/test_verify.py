import unittest

from memo.lru import LRUCache, lru_memoize


class VerifyLRU(unittest.TestCase):
    def test_put_get(self):
        cache = LRUCache(2)
        cache.put("a", 1)
        self.assertEqual((cache.get("a"), cache.get("zz", "none")), (1, "none"))
        self.assertEqual((cache.hits, cache.misses), (1, 1))

    def test_evicts_oldest_unused(self):
        cache = LRUCache(2)
        for key in "abc":
            cache.put(key, key.upper())
        self.assertEqual(cache.keys(), ["b", "c"])

    def test_get_refreshes(self):
        cache = LRUCache(2)
        cache.put("a", 1)
        cache.put("b", 2)
        cache.get("a")
        cache.put("c", 3)
        self.assertEqual(sorted(cache.keys()), ["a", "c"])

    def test_put_existing_refreshes_and_updates(self):
        cache = LRUCache(2)
        cache.put("a", 1)
        cache.put("b", 2)
        cache.put("a", 10)
        cache.put("c", 3)
        self.assertEqual((cache.get("a"), "b" in cache), (10, False))

    def test_keys_order(self):
        cache = LRUCache(3)
        for key in "abc":
            cache.put(key, 0)
        cache.get("a")
        cache.put("b", 1)
        self.assertEqual(cache.keys(), ["c", "a", "b"])

    def test_contains_does_not_refresh(self):
        cache = LRUCache(2)
        cache.put("a", 1)
        cache.put("b", 2)
        self.assertIn("a", cache)
        cache.put("c", 3)
        self.assertEqual(cache.keys(), ["b", "c"])

    def test_capacity(self):
        with self.assertRaises(ValueError):
            LRUCache(0)
        cache = LRUCache(1)
        cache.put("a", 1)
        cache.put("b", 2)
        self.assertEqual((len(cache), cache.keys()), (1, ["b"]))

    def test_memoize(self):
        calls = []

        @lru_memoize(2)
        def square(x):
            calls.append(x)
            return x * x

        for x in (1, 2, 1, 3, 1, 2):
            square(x)
        self.assertEqual(calls, [1, 2, 3, 2])


if __name__ == "__main__":
    unittest.main()
