from ds4t.cli import main

raise SystemExit(main())
