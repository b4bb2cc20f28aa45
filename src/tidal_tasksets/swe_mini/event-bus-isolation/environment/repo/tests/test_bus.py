import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from events.bus import EventBus


class BusTest(unittest.TestCase):
    def test_publish_calls_handlers(self):
        bus = EventBus()
        seen = []
        bus.subscribe("order.paid", seen.append)
        self.assertEqual(bus.publish("order.paid", 42), 1)
        self.assertEqual(seen, [42])

    def test_buses_are_isolated(self):
        audit, billing = EventBus(), EventBus()
        audit.subscribe("user.created", lambda payload: None)
        self.assertEqual(billing.publish("user.created", {"id": 1}), 0)


if __name__ == "__main__":
    unittest.main()
