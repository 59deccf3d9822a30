//! A real Redis for the quota service's tests: Debian's `redis-server` (found on `PATH`;
//! `cargo xtask test` installs it) on loopback, without persistence, in a temporary directory.
//! [`Redis::stop`] and [`Redis::start`] take it down and bring it back on the same port, empty,
//! as a store that crashed and restarted; dropping it kills it.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::loopback_ca::LoopbackCa;
use crate::{Sidecar, spawn_owned, wait_for};

/// The environment variable the sidecar reads the store's URL from in tests
/// (`quota.redis_url_env`).
pub const REDIS_URL_ENV: &str = "WEIR_REDIS_URL";

pub struct Redis {
    pub port: u16,
    /// For a server on TLS only: the PEM file of the CA that signed its certificate.
    pub ca_file: Option<PathBuf>,
    child: Option<Child>,
    dir: tempfile::TempDir,
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Redis {
    /// A new server on a free loopback port, answering PING (else panics).
    pub fn launch() -> Redis {
        Redis::launch_with(false)
    }

    /// A new server that speaks TLS only (`rediss://`), with a certificate for 127.0.0.1
    /// signed by a CA of its own ([`Redis::ca_file`]).
    pub fn launch_tls() -> Redis {
        Redis::launch_with(true)
    }

    fn launch_with(tls: bool) -> Redis {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let ca_file = tls.then(|| {
            let ca = LoopbackCa::new();
            std::fs::write(dir.path().join("server.pem"), ca.leaf_pem).unwrap();
            std::fs::write(dir.path().join("server.key"), ca.key_pem).unwrap();
            let ca_file = dir.path().join("ca.pem");
            std::fs::write(&ca_file, ca.ca_pem).unwrap();
            ca_file
        });
        let mut redis = Redis {
            port,
            ca_file,
            child: None,
            dir,
        };
        redis.start();
        redis
    }

    pub fn url(&self) -> String {
        let scheme = if self.ca_file.is_some() {
            "rediss"
        } else {
            "redis"
        };
        format!("{scheme}://127.0.0.1:{}/", self.port)
    }

    /// Starts the server (again) on its port, empty; waits until it answers.
    pub fn start(&mut self) {
        assert!(self.child.is_none(), "redis-server is already running");
        let log = std::fs::File::create(self.dir.path().join("redis.log")).unwrap();
        let mut cmd = Command::new("redis-server");
        let port = self.port.to_string();
        cmd.current_dir(self.dir.path())
            .args(["--bind", "127.0.0.1"]);
        match &self.ca_file {
            None => cmd.args(["--port", &port]),
            Some(ca) => cmd
                .args([
                    "--port",
                    "0",
                    "--tls-port",
                    &port,
                    "--tls-auth-clients",
                    "no",
                ])
                .args([
                    "--tls-cert-file",
                    "server.pem",
                    "--tls-key-file",
                    "server.key",
                ])
                .arg("--tls-ca-cert-file")
                .arg(ca),
        };
        cmd.args(["--save", "", "--appendonly", "no"])
            .args(["--dir", &self.dir.path().display().to_string()])
            .stdout(Stdio::from(log))
            .stderr(Stdio::null());
        self.child = Some(spawn_owned(cmd));
        wait_for(Duration::from_secs(10), || {
            let pong: String = ::redis::cmd("PING").query(&mut self.connection()?).ok()?;
            (pong == "PONG").then_some(())
        })
        .unwrap_or_else(|| panic!("redis-server did not answer:\n{}", self.log()));
    }

    /// Kills the server (as a crash would); its data is gone.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Freezes the server (SIGSTOP): connections stay open and nothing answers, as a store
    /// that hangs. [`Redis::resume`] thaws it.
    pub fn pause(&self) {
        self.signal(libc::SIGSTOP);
    }

    pub fn resume(&self) {
        self.signal(libc::SIGCONT);
    }

    fn signal(&self, signal: libc::c_int) {
        let child = self.child.as_ref().expect("redis-server is running");
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(child.id() as libc::pid_t, signal);
        }
    }

    pub fn flushall(&self) {
        self.command::<()>(&["FLUSHALL"]);
    }

    /// Runs one command and returns its reply.
    pub fn command<T: ::redis::FromRedisValue>(&self, args: &[&str]) -> T {
        let mut cmd = ::redis::cmd(args[0]);
        for arg in &args[1..] {
            cmd.arg(*arg);
        }
        let mut conn = self.connection().expect("redis connection");
        cmd.query(&mut conn)
            .unwrap_or_else(|e| panic!("{args:?}: {e}"))
    }

    /// The quota service's store on this server, its keys under `prefix` (a test's own).
    pub fn store(&self, prefix: &str) -> weir_sidecar::quota::Store {
        weir_sidecar::quota::Store::new(
            &self.url(),
            None,
            prefix,
            Duration::from_secs(2),
            Duration::from_secs(1),
        )
        .unwrap()
    }

    /// Keys in the store.
    pub fn dbsize(&self) -> u64 {
        self.command(&["DBSIZE"])
    }

    fn connection(&self) -> Option<::redis::Connection> {
        let client = match &self.ca_file {
            None => ::redis::Client::open(self.url()),
            Some(ca) => ::redis::Client::build_with_tls(
                self.url(),
                ::redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(std::fs::read(ca).ok()?),
                },
            ),
        };
        client
            .ok()?
            .get_connection_with_timeout(Duration::from_secs(1))
            .ok()
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("redis.log")).unwrap_or_default()
    }
}

impl Sidecar {
    /// A sidecar serving the simulator's `tiny` on `sim_url` (up to 64 queued per tenant) with
    /// the quota service on `redis`, its replica probed.
    pub fn quota_service(sim_url: &str, redis: &Redis) -> Sidecar {
        let sidecar = Sidecar::start_with_quota(
            &crate::sidecar_bin(),
            serde_json::json!({
                "queue": {"max_per_tenant": 64, "deadline_ms": 20000},
                "pools": [{"model": "tiny", "replicas": [sim_url]}],
            }),
            redis,
        );
        sidecar.wait_for_probes(1);
        sidecar
    }

    /// Starts the sidecar with `config` and a `quota` section (unless it has one) on `redis`,
    /// whose URL goes in through [`REDIS_URL_ENV`] (and its CA file, for TLS).
    pub fn start_with_quota(bin: &Path, mut config: serde_json::Value, redis: &Redis) -> Sidecar {
        if config.get("quota").is_none() {
            config["quota"] = serde_json::json!({"redis_url_env": REDIS_URL_ENV});
        }
        if let Some(ca) = &redis.ca_file {
            config["quota"]["ca_file"] = ca.display().to_string().into();
        }
        Sidecar::start_with_env(bin, config, &[], &[(REDIS_URL_ENV, &redis.url())])
    }
}
