"""The terminal summary printed at the end of a run (harness.core.summary)."""

from harness.core.summary import summary_table
from workloads.base import MEMORY_COLUMNS


def test_a_field_that_is_not_a_number_does_not_stop_the_summary():
    """A run measured every point, then crashed printing its summary because an adapter put a
    tensor's text ('tensor(48640)') where a byte count belongs. The table is printed, the value as
    it is, and the other cells formatted."""
    rows = [{"engine": "hf", "status": "ok", "kv_reserved_bytes": None, "kv_used_bytes": "tensor(48640)",
             "peak_memory_bytes": 3 * 2**20}]
    text = summary_table(rows, MEMORY_COLUMNS)
    line = text.splitlines()[2]
    assert "tensor(48640)" in line and "3.00" in line and "-" in line
