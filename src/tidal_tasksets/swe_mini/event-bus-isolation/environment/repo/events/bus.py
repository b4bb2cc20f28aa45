"""A synchronous publish/subscribe event bus."""


class EventBus:
    handlers = {}   # event name -> list of handlers
    published = []  # names of the events published, oldest first

    def subscribe(self, event, handler):
        """Call `handler(payload)` for every `event`; returns an unsubscribe function."""
        self.handlers.setdefault(event, []).append(handler)
        return lambda: self.unsubscribe(event, handler)

    def unsubscribe(self, event, handler):
        handlers = self.handlers.get(event, [])
        if handler in handlers:
            handlers.remove(handler)

    def publish(self, event, payload=None):
        """Call the event's handlers in subscription order; returns how many were called."""
        self.published.append(event)
        called = 0
        for handler in list(self.handlers.get(event, [])):
            handler(payload)
            called += 1
        return called

    def history(self):
        return list(self.published)

    def clear(self):
        """Drop every subscription and the history."""
        self.handlers.clear()
        self.published.clear()
