"""Real instruct targets that install from the package registry (no hub), and chat data for
them: ``target.path=smollm2`` (train.py) and ``model=smollm2`` (infer.py) name one."""
