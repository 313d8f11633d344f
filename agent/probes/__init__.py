"""Pure parsers for what the node agent learns about its host.

Every module here turns the text of a tool or kernel interface (``nvidia-smi``,
``/proc``, ``/sys``, ``dmesg``, ``sensors``) into dataclasses.  The parsers do no
I/O of their own (the few readers that walk ``/proc`` or ``/sys`` say so in their
name and take the root directory as an argument, so tests can point them at a
fixture tree), never raise on odd input, and follow one rule throughout:
unknown is not zero.  A value the tool did not report (``N/A``, ``[N/A]``,
``Not Supported``, a missing field, an unparsable string) is ``None``; an
unmeasured sensor is absent.  What could not be parsed is described in a
``warnings`` list of human-readable sentences instead.

This package must not import Django and must stay importable on Python 3.11.
"""
