"""`python -m nebula_fl.wan`: one cluster's emulated WAN link as a process (see ``service.py``)."""

from nebula_fl.wan.service import main

raise SystemExit(main())
