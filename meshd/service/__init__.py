"""meshd and meshd-relay as services: systemd units (Linux) and launchd jobs (macOS), rendered for
this installation and installed, inspected and removed by ``meshctl service``."""
