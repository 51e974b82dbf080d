"""Models that pockjax fine-tunes (see :mod:`pockjax.models.llama`)."""
