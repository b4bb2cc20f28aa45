"""A priority queue of jobs: lower priority numbers run first, FIFO among equals."""

import heapq
import itertools


class JobQueue:
    def __init__(self):
        self._heap = []                  # (priority, sequence number, job_id)
        self._jobs = {}                  # job_id -> payload, for queued jobs only
        self._seq = itertools.count()
        self._ids = itertools.count(1)

    def submit(self, payload, priority=0):
        """Queue a job; returns its id."""
        job_id = next(self._ids)
        heapq.heappush(self._heap, (priority, next(self._seq), job_id))
        self._jobs[job_id] = payload
        return job_id

    def pop(self):
        """Remove and return (job_id, payload) of the next job; IndexError when empty."""
        raise NotImplementedError("pop is not implemented yet")

    def cancel(self, job_id):
        """Cancel a queued job: True if it was queued, else False."""
        raise NotImplementedError("cancel is not implemented yet")

    def pending(self):
        """The ids of the queued jobs, in the order they will run."""
        return [job_id for _, _, job_id in sorted(self._heap) if job_id in self._jobs]

    def __len__(self):
        return len(self._jobs)

    def __contains__(self, job_id):
        return job_id in self._jobs
