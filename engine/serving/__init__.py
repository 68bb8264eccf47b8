"""Serving: the resident engine (``engine``: one model, many concurrent streams), request planning
(``plan``), bounded admission, the token chunk schedule (``streaming``), token2wav's deadline-ordered queue
(``job_queue``), worker and batching (``token2wav``), the client's playback clock and per-request metrics."""
