"""The I/O helpers the broker and the router share: files, sockets, threads and trio live here."""
