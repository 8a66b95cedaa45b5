from raystate.cli import main

raise SystemExit(main())
