"""Each drafter method's settings: its ``drafter`` and ``objective`` sections, one module per
method (the objective that reads them is ``train/objectives/<method>.py``). Light modules (no
torch), so that composing a config, ``--help`` and the planner do not load the training code."""
