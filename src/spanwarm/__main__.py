from spanwarm.cli import main

raise SystemExit(main())
