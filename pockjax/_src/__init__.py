"""pockjax internals shared by every pass (not a public API)."""
