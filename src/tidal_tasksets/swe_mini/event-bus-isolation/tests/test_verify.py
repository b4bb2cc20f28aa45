import unittest

from events.bus import EventBus


class VerifyBus(unittest.TestCase):
    def test_publish_calls_handlers_in_order(self):
        bus = EventBus()
        seen = []
        bus.subscribe("order.paid", lambda p: seen.append(("a", p)))
        bus.subscribe("order.paid", lambda p: seen.append(("b", p)))
        self.assertEqual(bus.publish("order.paid", 42), 2)
        self.assertEqual(seen, [("a", 42), ("b", 42)])

    def test_unsubscribe_function(self):
        bus = EventBus()
        seen = []
        stop = bus.subscribe("tick.unsub", seen.append)
        bus.publish("tick.unsub", 1)
        stop()
        bus.publish("tick.unsub", 2)
        self.assertEqual(seen, [1])

    def test_subscribed_twice(self):
        bus = EventBus()
        seen = []
        bus.subscribe("ping.twice", seen.append)
        bus.subscribe("ping.twice", seen.append)
        bus.publish("ping.twice", "x")
        self.assertEqual(seen, ["x", "x"])

    def test_buses_are_isolated(self):
        audit, billing = EventBus(), EventBus()
        audit.subscribe("user.created", lambda payload: None)
        self.assertEqual(billing.publish("user.created", {"id": 1}), 0)

    def test_new_bus_has_no_subscribers(self):
        EventBus().subscribe("job.done", lambda payload: None)
        self.assertEqual(EventBus().publish("job.done"), 0)

    def test_history_is_per_bus(self):
        a, b = EventBus(), EventBus()
        a.publish("one")
        b.publish("two")
        a.publish("three")
        self.assertEqual((a.history(), b.history()), (["one", "three"], ["two"]))

    def test_clear_only_affects_one_bus(self):
        a, b = EventBus(), EventBus()
        seen = []
        b.subscribe("keep", seen.append)
        a.clear()
        b.publish("keep", 1)
        self.assertEqual(seen, [1])


if __name__ == "__main__":
    unittest.main()
