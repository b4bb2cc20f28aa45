import io
import unittest

from logstats.stats import error_rate, level_counts, parse_line, summarize

LOG = """2024-05-01T12:00:00 INFO web: started
2024-05-01T12:00:01 ERROR db: connection lost
this line is garbage
2024-05-01T12:00:02 INFO web: request served
2024-05-01T12:00:03 WARNING web: slow request
2024-05-01T12:00:04 CRITICAL db: disk full
2024-05-01T12:00:05 ERROR cache: evicted: too big
2024-05-01T12:00:06 ERROR db: retry failed
"""

EXPECTED_SUMMARY = {
    "total": 7,
    "levels": {"DEBUG": 0, "INFO": 2, "WARNING": 1, "ERROR": 3, "CRITICAL": 1},
    "error_rate": 4 / 7,
    "top_error_source": "db",
}


class VerifyStats(unittest.TestCase):
    def test_parse_line(self):
        e = parse_line("2024-05-01T12:00:05 ERROR cache: evicted: too big")
        self.assertEqual((e.level, e.source, e.message), ("ERROR", "cache", "evicted: too big"))
        self.assertIsNone(parse_line("garbage"))
        self.assertIsNone(parse_line("2024-05-01T12:00:05 LOUD x: y"))

    def test_error_rate_list(self):
        self.assertAlmostEqual(error_rate(LOG.splitlines()), 4 / 7)

    def test_error_rate_file(self):
        self.assertAlmostEqual(error_rate(io.StringIO(LOG)), 4 / 7)

    def test_error_rate_generator(self):
        lines = (line for line in LOG.splitlines() if "web" not in line)
        self.assertAlmostEqual(error_rate(lines), 1.0)

    def test_error_rate_empty(self):
        self.assertEqual(error_rate([]), 0.0)
        self.assertEqual(error_rate(iter(["garbage"])), 0.0)

    def test_level_counts_generator(self):
        counts = level_counts(line for line in LOG.splitlines())
        self.assertEqual(counts, EXPECTED_SUMMARY["levels"])

    def test_summarize_list(self):
        self.assertEqual(summarize(LOG.splitlines()), EXPECTED_SUMMARY)

    def test_summarize_file(self):
        self.assertEqual(summarize(io.StringIO(LOG)), EXPECTED_SUMMARY)

    def test_summarize_empty(self):
        self.assertEqual(summarize(iter([]))["top_error_source"], None)


if __name__ == "__main__":
    unittest.main()
