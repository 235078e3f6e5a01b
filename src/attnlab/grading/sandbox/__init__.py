"""The sandbox that runs a learner's file: what runs inside it, how it is fenced, what may cross.

Learner code is hostile, and **it runs arbitrary code**: whatever the static check and the
call recorders say, design for a process that does anything it likes. The guarantees hold
because of what is (and is not) within its reach, not because of what it is told:

==================  ==================================================================
Module              Concept
==================  ==================================================================
:mod:`.server`      The only code that runs inside: load the file, call its functions,
                    send the values back. Imports the standard library and torch, never
                    attnlab. With :mod:`.protocol`, :mod:`.frames`, :mod:`.seccomp`,
                    :mod:`.recorder`, :mod:`.interpreter` and :mod:`.template` it is the *runner*, the only
                    files bound into the sandbox (:data:`.bwrap.RUNNER_FILES`).
:mod:`.protocol`    What may cross, both ways: safetensors and bounded JSON, every size
                    checked before anything is allocated. No pickle, no zip.
:mod:`.frames`      Length-prefixed frames on a pipe, reads with deadlines.
:mod:`.seccomp`     The filter on every process that runs learner code (no ptrace,
                    pidfd_getfd, process_vm_*, namespaces, mounts): libseccomp, or a
                    classic BPF program written out where libseccomp is missing.
:mod:`.recorder`    Torch call recorders in the child: advisory evidence for the report
                    (a removed recorder is itself reported), never a fence.
:mod:`.interpreter` Triton's interpreter as the child runs lab 05: launches counted per
                    kernel, masked loads without ``other=`` poisoned with NaN, warmed once.
:mod:`.template`    The class template's inside: one interpreter that imports torch once
                    and forks each submission into namespaces of its own.
:mod:`.bwrap`       The OS sandbox's command line: the identity that owns nothing on the
                    host, the read-only binds, a fresh read-only ``/dev``, seccomp.
:mod:`.pool`        Starting servers (per submission, spare, from the template, or as a
                    fresh uid without bwrap: mode ``user``), cgroups, stopping them all.
:mod:`.user`        Mode ``user`` (Gradescope without bwrap, root only): a fresh uid in a
                    session of its own, the runner's copy, every process of the uid killed.
:mod:`.client`      The grader's side: :class:`Sandbox`, :class:`Limits`, :class:`Call`,
                    :class:`Outcome`, validation of every answer, :func:`self_test`.
==================  ==================================================================

Names of :mod:`.client` are loaded lazily from here (``from attnlab.grading.sandbox import
Sandbox``), so importing :mod:`.pool` or :mod:`.bwrap` stays free of torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Limits", "Call", "Outcome", "Sandbox", "Unsupported", "validate_message", "clean_text", "printable", "self_test",
           "MAX_RESULT_BYTES", "MAX_ELEMENTS", "MAX_SOURCE_BYTES", "SUBMISSION_NAME", "submission_name",
           "BadMessage"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("attnlab.grading.sandbox.client"), name)
    raise AttributeError(f"module 'attnlab.grading.sandbox' has no attribute {name!r}")
