//! A real PostgreSQL server on loopback for the ledger tests: a fresh cluster (`initdb`) in a
//! temporary directory, trust authentication, listening on 127.0.0.1 at a free port with its
//! unix sockets in that directory. [`Postgres::stop`] and [`Postgres::start_again`] keep the
//! port and the data (an outage and a recovery); dropping it stops it.
//!
//! `initdb` and `postgres` refuse to run as root, which CI is: then they run as the `postgres`
//! user the Debian package creates (the directory is given to it). Binaries are found under
//! `/usr/lib/postgresql/*/bin` (Debian's place, the newest version first) or on `PATH`.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::{spawn_owned, wait_for};

pub struct Postgres {
    pub port: u16,
    bin: PathBuf,
    /// The uid and gid servers run as (the `postgres` user when this process is root).
    user: Option<(u32, u32)>,
    dir: tempfile::TempDir,
    child: Option<Child>,
}

/// The directory holding `initdb` and `postgres`.
pub fn bin_dir() -> PathBuf {
    let mut debian: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("bin"))
        .filter(|bin| bin.join("postgres").exists())
        .collect();
    debian.sort_by_key(|bin| {
        let version = bin.parent().and_then(Path::file_name);
        version.and_then(|v| v.to_str()?.parse::<u32>().ok())
    });
    if let Some(newest) = debian.pop() {
        return newest;
    }
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .find(|dir| dir.join("postgres").exists() && dir.join("initdb").exists())
        .expect(
            "PostgreSQL not found (Debian: apt-get install postgresql; `cargo xtask test` does)",
        )
}

/// The `postgres` user's uid and gid, when this process is root.
fn server_user() -> Option<(u32, u32)> {
    // SAFETY: geteuid has no preconditions; getpwnam's result is read at once, on one thread.
    unsafe {
        if libc::geteuid() != 0 {
            return None;
        }
        let pw = libc::getpwnam(c"postgres".as_ptr());
        assert!(
            !pw.is_null(),
            "running as root, and there is no postgres user to run PostgreSQL as"
        );
        Some(((*pw).pw_uid, (*pw).pw_gid))
    }
}

impl Postgres {
    /// Creates a cluster and starts it.
    pub fn start() -> Postgres {
        let bin = bin_dir();
        let user = server_user();
        let dir = tempfile::tempdir().unwrap();
        if let Some((uid, gid)) = user {
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid)).unwrap();
        }
        let mut initdb = Command::new(bin.join("initdb"));
        initdb
            .args(["--auth=trust", "--username=postgres", "--no-sync", "-D"])
            .arg(dir.path().join("data"))
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        if let Some((uid, gid)) = user {
            initdb.uid(uid).gid(gid);
        }
        let out = initdb.output().unwrap();
        assert!(
            out.status.success(),
            "initdb: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut pg = Postgres {
            port,
            bin,
            user,
            dir,
            child: None,
        };
        pg.start_again();
        pg
    }

    /// `postgresql://` URL of the `postgres` database, as the sidecar's `ledger_store` reads it.
    pub fn url(&self) -> String {
        format!("postgresql://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Writes [`Postgres::url`] to a file (for `url_file` and `weir usage --postgres-url-file`).
    pub fn url_file(&self) -> PathBuf {
        let path = self.dir.path().join("url");
        std::fs::write(&path, self.url()).unwrap();
        path
    }

    /// Starts the server (again) on the same port and data; returns once it accepts
    /// connections.
    pub fn start_again(&mut self) {
        assert!(self.child.is_none(), "already running");
        let log = std::fs::File::create(self.dir.path().join("postgres.log")).unwrap();
        let mut cmd = Command::new(self.bin.join("postgres"));
        cmd.arg("-D")
            .arg(self.dir.path().join("data"))
            .args(["-p", &self.port.to_string(), "-k"])
            .arg(self.dir.path())
            .args(["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"])
            .stdout(Stdio::null())
            .stderr(Stdio::from(log));
        if let Some((uid, gid)) = self.user {
            cmd.uid(uid).gid(gid);
        }
        self.child = Some(spawn_owned(cmd));
        let url = self.url();
        wait_for(Duration::from_secs(30), || {
            std::net::TcpStream::connect(("127.0.0.1", self.port)).ok()?;
            postgres_accepts(&url).then_some(())
        })
        .unwrap_or_else(|| panic!("PostgreSQL did not start: {}", self.log()));
    }

    /// Stops the server (fast shutdown: connections are cut, as in an outage) and waits for it
    /// to exit.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SAFETY: kill(2) on our own child's pid.
            unsafe {
                libc::kill(child.id() as libc::pid_t, libc::SIGINT);
            }
            let _ = child.wait();
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("postgres.log")).unwrap_or_default()
    }
}

/// Whether a client can log in and run a query (the server may listen before it accepts).
fn postgres_accepts(url: &str) -> bool {
    postgres::Client::connect(url, postgres::NoTls)
        .and_then(|mut c| c.simple_query("SELECT 1"))
        .is_ok()
}

impl Drop for Postgres {
    fn drop(&mut self) {
        self.stop();
    }
}
