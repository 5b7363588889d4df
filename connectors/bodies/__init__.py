"""Body formats: how a topic's message bodies become typed columns (``base.BodyFormat``)."""
