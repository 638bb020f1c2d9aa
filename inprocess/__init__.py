"""Rank processes that outlive their generations: what megaheal's warm workers (train/warm/worker.py) and a user's
in-process restart (megaheal.rank.restartable) share. A generation is one formation of the job's process group;
when a peer dies the survivors abort it, leave it, and join the next one without a new process (wire/warm_plan.py
is the control plane, the pool's store).

- generations.py: the loop a process runs from plan to plan (join, run, abort when replaced, leave);
- abort.py: making every collective of a generation fail at once, from another thread;
- leave.py: leaving a process group with nothing left holding it.

torch.distributed and the wire only: the trainer and the public rank API both stand on it.
"""
