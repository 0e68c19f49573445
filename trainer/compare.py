"""Alias kept for ``python -m trainer.compare``: the tool lives in ``trainer.tools.compare`` (``packfsdp compare``)."""

from trainer.tools.compare import main

if __name__ == "__main__":
    main()
