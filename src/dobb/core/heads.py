"""Head-aligned blocks: moved to ``dobb.attention_heads`` (shared by Dobb and the Muon family); this name stays."""
from ..attention_heads import (OUT_NAMES, QKV_NAMES, check_heads_apply, head_blocks, head_rows,  # noqa: F401
                               role, shapes_note)

__all__ = ["QKV_NAMES", "OUT_NAMES", "role", "head_blocks", "head_rows", "check_heads_apply", "shapes_note"]
