"""Alias kept for ``python -m trainer.export``: the tool lives in ``trainer.tools.export`` (``packfsdp export``)."""

if __name__ == "__main__":
    from trainer.tools.export import main

    main()
