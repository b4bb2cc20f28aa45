"""Tasks with labels, and the board that holds them."""


def _normalise(label):
    return label.strip().lower()


class Task:
    def __init__(self, title, labels=[], assignee=None):
        self.title = title
        self.labels = labels
        self.assignee = assignee
        self.done = False

    def add_label(self, label):
        label = _normalise(label)
        if label and label not in self.labels:
            self.labels.append(label)

    def remove_label(self, label):
        label = _normalise(label)
        if label in self.labels:
            self.labels.remove(label)

    def complete(self):
        self.done = True

    def __repr__(self):
        return f"Task({self.title!r}, labels={self.labels!r})"


class Board:
    def __init__(self):
        self.tasks = []

    def create(self, title, *labels, assignee=None):
        task = Task(title, assignee=assignee)
        for label in labels:
            task.add_label(label)
        self.tasks.append(task)
        return task

    def with_label(self, label):
        label = _normalise(label)
        return [task for task in self.tasks if label in task.labels]

    def open_tasks(self):
        return [task for task in self.tasks if not task.done]
