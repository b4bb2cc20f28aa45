import unittest

from accounts.api import handle_get_user
from accounts.store import Directory, load_users

CSV = """id,name,email,active
7,Ada,ada@example.com,yes
1000,Grace,Grace@Example.com,no
4096,Linus,linus@example.com,yes
123456789,Barbara,barbara@example.com,yes
"""


class VerifyAccounts(unittest.TestCase):
    def setUp(self):
        self.directory = Directory(load_users(CSV))

    def test_small_id(self):
        self.assertEqual(handle_get_user(self.directory, "/users/7"),
                         (200, {"id": 7, "name": "Ada"}))

    def test_large_id_via_api(self):
        self.assertEqual(handle_get_user(self.directory, "/users/1000"),
                         (200, {"id": 1000, "name": "Grace"}))

    def test_very_large_id_via_api(self):
        status, body = handle_get_user(self.directory, "/users/123456789")
        self.assertEqual((status, body.get("name")), (200, "Barbara"))

    def test_by_id_with_computed_int(self):
        user = self.directory.by_id(int("40") * 100 + 96)
        self.assertIsNotNone(user)
        self.assertEqual(user.name, "Linus")

    def test_unknown_id(self):
        self.assertEqual(handle_get_user(self.directory, "/users/8")[0], 404)
        self.assertEqual(handle_get_user(self.directory, "/users/99999")[0], 404)

    def test_bad_paths(self):
        self.assertEqual(handle_get_user(self.directory, "/users/abc")[0], 400)
        self.assertEqual(handle_get_user(self.directory, "/groups/7")[0], 400)

    def test_by_email_is_case_insensitive(self):
        self.assertEqual(self.directory.by_email(" grace@EXAMPLE.com").id, 1000)

    def test_active_ids(self):
        self.assertEqual(self.directory.active_ids(), [7, 4096, 123456789])


if __name__ == "__main__":
    unittest.main()
