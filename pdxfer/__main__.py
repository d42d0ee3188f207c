from pdxfer.cli import main

raise SystemExit(main())
