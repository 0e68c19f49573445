"""Alias kept for ``python -m trainer.variability``: the tool lives in ``trainer.tools.variability`` (``packfsdp variability``)."""

if __name__ == "__main__":
    from trainer.tools.variability import main

    main()
