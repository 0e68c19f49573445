"""Alias kept for ``python -m trainer.analyze``: the tool lives in ``trainer.tools.analyze`` (``packfsdp analyze``)."""

if __name__ == "__main__":
    from trainer.tools.analyze import main

    main()
