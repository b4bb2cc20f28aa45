"""Request handlers of the user API."""


def handle_get_user(directory, path):
    """GET /users/<id> -> (status, body)."""
    parts = path.strip("/").split("/")
    if len(parts) != 2 or parts[0] != "users" or not parts[1].isdigit():
        return 400, {"error": "bad path"}
    user = directory.by_id(int(parts[1]))
    if user is None:
        return 404, {"error": "no such user"}
    return 200, {"id": user.id, "name": user.name}
