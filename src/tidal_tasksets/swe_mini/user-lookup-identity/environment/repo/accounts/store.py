"""A user directory loaded from a CSV export."""

import csv
import io
from dataclasses import dataclass


@dataclass(frozen=True)
class User:
    id: int
    name: str
    email: str
    active: bool


def load_users(text):
    """Users from CSV text with the header id,name,email,active (active: yes/no)."""
    users = []
    for row in csv.DictReader(io.StringIO(text)):
        users.append(User(
            id=int(row["id"]),
            name=row["name"].strip(),
            email=row["email"].strip().lower(),
            active=row["active"].strip().lower() == "yes",
        ))
    return users


class Directory:
    def __init__(self, users):
        self.users = list(users)

    def by_id(self, user_id):
        for user in self.users:
            if user.id is user_id:
                return user
        return None

    def by_email(self, email):
        email = email.strip().lower()
        for user in self.users:
            if user.email == email:
                return user
        return None

    def active_ids(self):
        return sorted(user.id for user in self.users if user.active)
