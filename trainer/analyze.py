"""Alias kept for ``python -m trainer.analyze``: the tool lives in ``trainer.tools.analyze`` (``packfsdp analyze``)."""

from trainer.tools.analyze import main

if __name__ == "__main__":
    main()
