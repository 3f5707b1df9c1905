"""The continuous rollout schedule (``generator.schedule: continuous``): the engine is kept full, sequences are
submitted one by one and replaced as they finish, a group is scored and uploaded the moment its G completions are
done, and new weights are taken between two decoding steps instead of between engine calls.

* ``groups.py``: which sequences belong to which prompt, and when a group is complete;
* ``trajectories.py``: the same for multi-turn environments: a chain of turns per trajectory, the environment's
  calls between them on a thread pool;
* ``uploader.py``: a thread that scores complete groups and uploads them in batches, so the engine keeps stepping;
* ``schedule.py``: the loop that tops the engine up within the hub's budget, steps it and swaps weights;
* ``engines.py``: the continuous wrapper of each engine (generator/engines/*_continuous.py).
"""
