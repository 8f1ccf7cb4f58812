"""Adapters that plug flash-hopper into other libraries' attention hooks. Each imports its
library only when used, so the package installs and imports without any of them."""
