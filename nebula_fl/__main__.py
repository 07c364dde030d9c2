"""`python -m nebula_fl` is `nebula-fl`."""

from nebula_fl.cli import main

raise SystemExit(main())
