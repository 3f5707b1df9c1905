"""The scorer pool: the hub's one front for reference scoring, whoever does it (the hub's own scorer, scorers
that join over HTTP).

* ``pool.py``: :class:`ScorerPool`, what the hub's intake and the scoring routes submit to;
* ``jobs.py`` (its jobs: queued, leased, requeued, given up) and ``records.py`` (what it keeps: jobs, joined
  scorers, counters, the quarantine);
* ``job_wire.py``: a scoring job and its result on the wire (safetensors), and the checks a result passes;
* ``routes.py``: ``/v1/scorers/*``, where joined scorers register, pull jobs, post results and leave;
* ``remote.py``: the joined scorer itself (``grpo scorer --hub URL``).
"""
