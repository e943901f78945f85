"""``python -m graftmerge ...``, the same as the ``graftmerge`` command.

Handy where a module is needed instead of a script, e.g.
``torchrun --nproc-per-node 4 -m graftmerge fisher estimate ./post -o fisher/post``.
"""

from graftmerge.cli import main

if __name__ == "__main__":
    main()
