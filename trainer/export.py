"""Alias kept for ``python -m trainer.export``: the tool lives in ``trainer.tools.export`` (``packfsdp export``)."""

from trainer.tools.export import main

if __name__ == "__main__":
    main()
