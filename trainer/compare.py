"""Alias kept for ``python -m trainer.compare``: the tool lives in ``trainer.tools.compare`` (``packfsdp compare``)."""

if __name__ == "__main__":
    from trainer.tools.compare import main

    main()
