//! A proxy-wasm HTTP filter that does nothing but hold the request body until it is complete,
//! as weir's filter does: what any filter costs in Envoy's V8 (a VM call per callback, the
//! SDK's context bookkeeping). `cargo xtask bench` runs it beside weir's filter so the part of
//! the added latency that is weir's own work can be told from the sandbox's.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType};

proxy_wasm::main! {{
    proxy_wasm::set_root_context(|_| Box::new(Root));
}}

struct Root;

impl Context for Root {}

impl RootContext for Root {
    fn create_http_context(&self, _: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Exchange))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Exchange;

impl Context for Exchange {}

impl HttpContext for Exchange {
    fn on_http_request_body(&mut self, _: usize, end_of_stream: bool) -> Action {
        if end_of_stream {
            Action::Continue
        } else {
            Action::Pause
        }
    }
}
