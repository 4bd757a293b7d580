"""The runs of one cell that ran different contents of the same file of one's own (`experiments.provenance`)."""

from __future__ import annotations

from typing import Any


def changed_sources(cells: list[dict[str, Any]]) -> list[str]:
    """One line for each cell and file of one's own whose runs recorded different sha256s of it, naming the runs
    and the file. Runs without a record (built-ins, or from before the records) are left out."""
    lines = []
    for cell in cells:
        seen: dict[str, dict[str, list[str]]] = {}  # the copy's name (the module) -> sha256 -> run labels
        paths: dict[str, list[str]] = {}
        for run in cell["runs"]:
            for source in run["summary"].attention_sources or []:
                seen.setdefault(source["copy"], {}).setdefault(source["sha256"], []).append(run["label"])
                paths.setdefault(source["copy"], []).append(source["path"])
        for copy, hashes in seen.items():
            if len(hashes) > 1:
                runs = "; ".join(f"{', '.join(dict.fromkeys(labels))} sha256 {h[:12]}" for h, labels in hashes.items())
                where = " or ".join(dict.fromkeys(paths[copy]))
                lines.append(
                    f"cell {cell['label']}: its runs used different contents of {where}: {runs}; "
                    f"each run folder keeps the contents it ran in {copy}"
                )
    return lines
