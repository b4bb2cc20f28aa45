#!/bin/bash
# Hidden verifier: runs /tests/test_verify.py against the code in /app (via grade.py) and
# writes the fraction of its tests that pass to /logs/verifier/reward.txt. A reward is
# always written (0.0 unless grade.py gets further), and the script always exits 0.
mkdir -p /logs/verifier
echo 0.0 > /logs/verifier/reward.txt
cd /app 2>/dev/null || true
export PYTHONDONTWRITEBYTECODE=1
timeout 50 python3 /tests/grade.py || echo "grade.py exited with status $?"
[ -s /logs/verifier/reward.txt ] || echo 0.0 > /logs/verifier/reward.txt
echo "reward: $(cat /logs/verifier/reward.txt)"
exit 0
