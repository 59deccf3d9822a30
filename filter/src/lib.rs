//! weir's Envoy filter (proxy-wasm): tenant auth, token estimation, quota reservation in shared
//! data, and streamed settlement. The decisions live in `weir-core`; `exchange` sequences them
//! for one HTTP exchange as a host-free state machine (tested natively); the rest of this crate
//! is the glue to Envoy's callbacks and host calls.

mod exchange;
#[cfg(feature = "fault-injection")]
mod fault;
mod host;
#[cfg(feature = "profile")]
mod profile;
mod renewal;
mod request;
mod signer;
mod tarpit;
mod telemetry;

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{BufferType, ContextType, LogLevel};
use weir_core::config::RunBudgets;
use weir_core::config::{Config, Directory, Tenant};
use weir_core::reservation::{self, Reservation};
use weir_core::run::fleet::Settle;
use weir_core::run::{self, RunHold, RunTable};

use crate::host::{Envoy, Metrics, SharedData};
use crate::renewal::Renewal;
use crate::request::Request;
use crate::signer::Signer;
use crate::tarpit::Tarpit;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| Box::new(Root::default()));
}}

/// What every request on a worker shares: the validated config and its key directory.
pub struct Gateway {
    pub config: Config,
    pub directory: Directory,
    /// Who unauthenticated requests on non-enforcing routes are scheduled as.
    pub default_tenant: Arc<Tenant>,
    /// Signs the trusted headers of every forwarded request, when configured.
    pub signer: Option<Signer>,
    pub metrics: Metrics,
    /// Reservations this VM's live requests hold, by slot lease id: the root context renews
    /// their slot leases on every tick, so a slot lapses only when its VM is gone.
    pub in_flight: RefCell<HashMap<u64, Reservation>>,
    /// What this VM's live calls hold of their runs, by call lease id: renewed with the slot
    /// leases, so a long call keeps its place among its run's calls in flight.
    pub runs_in_flight: RefCell<HashMap<u64, RunHold>>,
    /// Settles of runs' fleet-wide budgets, sent in batches on the root tick
    /// (`exchange::run_fleet`): a request's context may be gone before the store answers.
    pub run_settles: RefCell<VecDeque<Settle>>,
    /// The price table as every forwarded request vouches for it (`x-weir-price`), so the
    /// ledger prices each record at its model's entry; formatted once per configuration.
    pub price_header: Option<String>,
    /// Refusals of retries held back, sent on the root tick (`tarpit`).
    pub tarpit: RefCell<Tarpit>,
}

impl Gateway {
    pub(crate) fn new(config: Config, signer: Option<Signer>, metrics: Metrics) -> Gateway {
        Gateway {
            price_header: config.prices.as_ref().map(|p| p.to_header()),
            directory: config.directory(),
            default_tenant: Arc::new(config.default_tenant()),
            config,
            signer,
            metrics,
            in_flight: RefCell::default(),
            runs_in_flight: RefCell::default(),
            run_settles: RefCell::default(),
            tarpit: RefCell::default(),
        }
    }
}

#[derive(Default)]
struct Root {
    gateway: Option<Rc<Gateway>>,
    /// Renews fleet-wide leases, when the config has any.
    renewal: Option<Renewal>,
    /// When this VM last renewed its requests' slot leases.
    slots_renewed_ms: u64,
    /// Ticks between the fleet's renewals and runs' settles (more than one when the tick comes
    /// more often, for held refusals), and ticks since they last went.
    duties_every: u64,
    ticks: u64,
}

impl Context for Root {
    fn on_http_call_response(&mut self, token: u32, _: usize, body_size: usize, _: usize) {
        if let (Some(renewal), Some(gw)) = (self.renewal.as_mut(), &self.gateway) {
            renewal.answered(&Envoy::new(Rc::clone(gw)), token, body_size);
        }
    }
}

impl RootContext for Root {
    /// Validates the plugin configuration. An invalid one is logged with the offending field
    /// and refused, so Envoy does not start with it.
    fn on_configure(&mut self, _: usize) -> bool {
        let raw = hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX)
            .ok()
            .flatten()
            .unwrap_or_default();
        let config = match Config::parse(&raw) {
            Ok(config) => config,
            Err(e) => {
                log::error!("weir: invalid configuration: {e}");
                return false;
            }
        };
        // Load vocabularies now rather than on a worker's first request.
        let encodings = config.models.values().filter_map(|m| m.encoding);
        for encoding in encodings.chain([config.default_encoding]) {
            if let Err(e) = encoding.bpe() {
                log::error!("weir: {e}");
                return false;
            }
        }
        let signer = match config.signing.as_ref().map(Signer::from_config).transpose() {
            Ok(signer) => signer,
            Err(e) => {
                log::error!("weir: invalid configuration: {e}");
                return false;
            }
        };
        let gateway = Gateway::new(config, signer, telemetry::define());
        self.renewal = Renewal::new(&gateway.config, &gateway.directory);
        // Renew three times per slot lease (a late tick or two never costs a live request its
        // slot), and fleet-wide leases every renewal period.
        let slot_period = gateway.config.slot_lease_ms / 3;
        let mut period = self
            .renewal
            .as_ref()
            .map_or(slot_period, |r| r.period_ms().min(slot_period));
        // Runs' fleet-wide settles go out every renewal period too.
        if let Some(fleet) = &gateway.config.fleet
            && (gateway.directory.tenants()).any(|t| t.run_fleet_wide != RunBudgets::default())
        {
            period = period.min(fleet.renew_ms);
        }
        // Held refusals go within a tick of their due time, where some key's retries can be
        // refused; the other duties keep their own period.
        let holds = (gateway.directory.tenants()).any(weir_core::retry::watched);
        let tick = match holds {
            true => period.clamp(1, tarpit::TICK_MS),
            false => period.max(1),
        };
        self.duties_every = period.div_ceil(tick).max(1);
        self.set_tick_period(Duration::from_millis(tick));
        reservation::initialize(&SharedData, gateway.directory.tenants(), host::now_ms());
        run::create(
            &SharedData,
            gateway.directory.tenants(),
            RunTable::default(),
        );
        weir_core::retry::prepare(&SharedData, gateway.directory.tenants());
        log::info!(
            "weir: configured with {} keys; trusted headers {}",
            gateway.directory.len(),
            if gateway.signer.is_some() {
                "signed"
            } else {
                "unsigned"
            }
        );
        if gateway.config.acts_on_no_named_route() {
            log::warn!(
                "weir: routes.default is `ignore` and routes.by_name names no route weir acts on: \
                 every request passes as it came, neither authenticated nor metered, unless its \
                 route's metadata sets a mode"
            );
        }
        self.gateway = Some(Rc::new(gateway));
        true
    }

    /// Renews the slot leases of every request in flight on this VM (one CAS update per
    /// concurrency limit on its path, so the cost is bounded by the requests this worker
    /// holds) every third of a slot lease, and fleet-wide leases every renewal period.
    fn on_tick(&mut self) {
        let Some(gw) = &self.gateway else {
            return;
        };
        let now = host::now_ms();
        let due = gw.tarpit.try_borrow_mut().map(|mut t| t.due(now));
        for held in due.unwrap_or_default() {
            host::reply_on(held.context_id, &held.reply);
        }
        self.ticks = self.ticks.wrapping_add(1);
        if !self.ticks.is_multiple_of(self.duties_every.max(1)) {
            return;
        }
        if let Some(renewal) = self.renewal.as_mut() {
            renewal.tick(&Envoy::new(Rc::clone(gw)), gw.signer.as_ref());
        }
        exchange::run_fleet::send_settles(&Envoy::new(Rc::clone(gw)), gw);
        if now
            < self
                .slots_renewed_ms
                .saturating_add(gw.config.slot_lease_ms / 3)
        {
            return;
        }
        // Callbacks never nest, so the map is never borrowed here; if it were, skip a tick.
        let Ok(in_flight) = gw.in_flight.try_borrow() else {
            return;
        };
        self.slots_renewed_ms = now;
        let conflicts: usize = in_flight
            .values()
            .map(|r| reservation::renew(&SharedData, r, now))
            .sum();
        if let Ok(runs) = gw.runs_in_flight.try_borrow() {
            for hold in runs.values() {
                run::renew(&SharedData, hold, gw.config.slot_lease_ms, now);
            }
        }
        gw.metrics
            .add(telemetry::SETTLE_CONFLICTS, conflicts as i64);
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        // Envoy does not start without a valid configuration, so a gateway is always there.
        let gateway = self
            .gateway
            .clone()
            .unwrap_or_else(|| Rc::new(Gateway::new(Config::default(), None, Metrics::default())));
        Some(Box::new(Request::new(gateway, context_id)))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
