"""The evaluation product: the acceptance harness (``harness``), what it produces
(``results``), its report (markdown, plots, W&B: ``report``), the k advisor (``advisor``) and
prompt sets (``prompt_sets``)."""
