import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from accounts.api import handle_get_user
from accounts.store import Directory, load_users

CSV = """id,name,email,active
7,Ada,ada@example.com,yes
1000,Grace,Grace@Example.com,no
"""


class ApiTest(unittest.TestCase):
    def setUp(self):
        self.directory = Directory(load_users(CSV))

    def test_small_id(self):
        self.assertEqual(handle_get_user(self.directory, "/users/7"),
                         (200, {"id": 7, "name": "Ada"}))

    def test_large_id(self):
        self.assertEqual(handle_get_user(self.directory, "/users/1000"),
                         (200, {"id": 1000, "name": "Grace"}))

    def test_unknown_id(self):
        self.assertEqual(handle_get_user(self.directory, "/users/8")[0], 404)


if __name__ == "__main__":
    unittest.main()
