from edgefleet.cli import main

raise SystemExit(main())
