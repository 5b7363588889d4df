"""The tiering query: the commitlog -> the tier (``query`` as the runner sees it, ``handler`` its batches)."""
