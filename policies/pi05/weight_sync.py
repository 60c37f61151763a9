"""Weight-sync hook (placeholder; being implemented)."""


class WeightSyncMixin:
    """Transactional in-place weight updates for `Pi05Policy` (see DESIGN C6)."""
