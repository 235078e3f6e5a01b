"""Process helpers for the grader's tests: which processes belong to the spare sandbox
server (started ahead, no learner code in it), so that leftover checks can ignore it."""

from __future__ import annotations

from pathlib import Path

from attnlab.grading import launch


def process_tree(root: int) -> set[int]:
    """``root`` and its descendants, from /proc/*/stat."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(proc.name))
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        tree.add(pid)
        todo.extend(children.get(pid, []))
    return tree


def spare_tree() -> set[int]:
    """Pids of the spare server's process tree (bwrap, its init, the server)."""
    spare = launch.spare()
    return process_tree(spare.proc.pid) if spare is not None else set()
