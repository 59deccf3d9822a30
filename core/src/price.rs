//! Prices per million tokens, and what a request costs at them.
//!
//! Money is counted in integer micro-units of the currency (1 USD = 1,000,000), so budgets are
//! plain counters like token limits and sums never drift. The filter reserves a request's cost
//! at its estimated size and settles it from the engine's counts; it tells the sidecar the price
//! used (the price table, in the signed [`crate::trusted::PRICE`] header), so the ledger records
//! each request's cost with the price in force when it ran.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Micro-units per unit of currency.
pub const MICROS: f64 = 1_000_000.0;

/// Largest price per million tokens accepted (in config and on the wire).
pub const MAX_PRICE: f64 = 1_000_000.0;

/// What a million tokens of each kind cost, in units of the currency.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Price {
    pub input: f64,
    /// Prompt tokens the engine served from its prefix cache; the input price when unset.
    #[serde(default)]
    pub cached_input: Option<f64>,
    pub output: f64,
}

/// A request's token counts, as priced.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Every prompt token, cached ones included.
    pub input_tokens: u64,
    /// Of `input_tokens`, those served from the prefix cache.
    pub cached_input_tokens: u64,
    pub output_tokens: u64,
}

impl Price {
    /// Whether every figure is a finite, non-negative price within [`MAX_PRICE`].
    pub fn is_valid(&self) -> bool {
        [self.input, self.cached_input(), self.output]
            .iter()
            .all(|p| p.is_finite() && (0.0..=MAX_PRICE).contains(p))
    }

    pub fn cached_input(&self) -> f64 {
        self.cached_input.unwrap_or(self.input)
    }

    /// The cost of `usage` in micro-units, rounded up (a fraction of a micro-unit is charged).
    pub fn cost_micros(&self, usage: Usage) -> u64 {
        let cached = usage.cached_input_tokens.min(usage.input_tokens);
        let uncached = usage.input_tokens - cached;
        // Price per token in micro-units is price-per-million as is.
        let micros = uncached as f64 * self.input
            + cached as f64 * self.cached_input()
            + usage.output_tokens as f64 * self.output;
        if micros.is_finite() && micros > 0.0 {
            micros.ceil().min(u64::MAX as f64) as u64
        } else {
            0
        }
    }
}

/// The top-level `prices` of the filter's config: per model, per million tokens, in one
/// currency. The filter vouches for the whole table in [`crate::trusted::PRICE`], since its
/// trusted headers go upstream before the body names the model; the sidecar prices each record
/// at its model's entry.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Prices {
    pub currency: String,
    #[serde(default)]
    pub models: BTreeMap<String, Price>,
    #[serde(default)]
    pub default: Option<Price>,
}

/// Marks the default's entry in the header (never a model: [`Prices::check`] refuses it).
const DEFAULT_ENTRY: &str = "*";

impl Prices {
    /// The price of `model`: its own, else the default.
    pub fn of(&self, model: &str) -> Option<&Price> {
        self.models.get(model).or(self.default.as_ref())
    }

    /// Why the table is invalid, as (field, message).
    pub fn check(&self) -> Result<(), (String, String)> {
        if !is_currency(&self.currency) {
            return Err((
                "prices.currency".into(),
                "1 to 8 ASCII letters, e.g. USD".into(),
            ));
        }
        for model in self.models.keys() {
            if !is_priced_model(model) {
                return Err((
                    format!("prices.models.{model}"),
                    "a model name of visible ASCII without `,` `;` `=`, and not `*`".into(),
                ));
            }
        }
        let named = self
            .models
            .iter()
            .map(|(m, p)| (format!("prices.models.{m}"), p));
        for (field, price) in named.chain(self.default.iter().map(|p| ("prices.default".into(), p)))
        {
            if !price.is_valid() {
                return Err((
                    field,
                    format!("prices per million tokens in [0, {MAX_PRICE}]"),
                ));
            }
        }
        Ok(())
    }

    /// The table as [`crate::trusted::PRICE`] carries it:
    /// `<currency>:<model>=<input>,<cached_input>,<output>;…`, the default as model `*`, e.g.
    /// `USD:*=0.1,0.05,0.4;llama-3.1-8b=0.15,0.075,0.6`.
    pub fn to_header(&self) -> String {
        let entries: Vec<String> = self
            .default
            .iter()
            .map(|p| (DEFAULT_ENTRY, p))
            .chain(self.models.iter().map(|(m, p)| (m.as_str(), p)))
            .map(|(name, p)| format!("{name}={},{},{}", p.input, p.cached_input(), p.output))
            .collect();
        format!("{}:{}", self.currency, entries.join(";"))
    }

    /// The inverse of [`Prices::to_header`]; `None` for anything else (a bad currency, entry or
    /// figure, a model named twice).
    pub fn parse_header(value: &str) -> Option<Prices> {
        let (currency, entries) = value.split_once(':')?;
        let mut prices = Prices {
            currency: currency.to_owned(),
            models: BTreeMap::new(),
            default: None,
        };
        for entry in entries.split(';') {
            let (name, figures) = entry.split_once('=')?;
            let figures: Vec<f64> = figures
                .split(',')
                .map(|f| f.parse::<f64>().ok())
                .collect::<Option<_>>()?;
            let [input, cached_input, output] = figures[..] else {
                return None;
            };
            let price = Price {
                input,
                cached_input: Some(cached_input),
                output,
            };
            let fresh = if name == DEFAULT_ENTRY {
                prices.default.replace(price).is_none()
            } else {
                prices.models.insert(name.to_owned(), price).is_none()
            };
            if !fresh {
                return None;
            }
        }
        prices.check().is_ok().then_some(prices)
    }
}

/// A model name a price table can hold: the names weir accepts, less the header's separators.
fn is_priced_model(name: &str) -> bool {
    name != DEFAULT_ENTRY && crate::trusted::is_model_name(name) && !name.contains([';', '='])
}

/// A currency code: 1–8 ASCII letters (`USD`, `EUR`, or a unit of the operator's own, `CREDITS`).
pub fn is_currency(code: &str) -> bool {
    (1..=8).contains(&code.len()) && code.bytes().all(|b| b.is_ascii_alphabetic())
}

#[cfg(test)]
mod tests {
    use super::*;

    const PRICE: Price = Price {
        input: 0.15,
        cached_input: Some(0.075),
        output: 0.6,
    };

    #[test]
    fn cost_charges_cached_prompt_tokens_at_their_own_price_and_rounds_up() {
        let usage = Usage {
            input_tokens: 1_000,
            cached_input_tokens: 400,
            output_tokens: 100,
        };
        // 600 × 0.15 + 400 × 0.075 + 100 × 0.6 = 90 + 30 + 60 micro-units.
        assert_eq!(PRICE.cost_micros(usage), 180);
        let one = Usage {
            input_tokens: 1,
            ..Usage::default()
        };
        assert_eq!(
            PRICE.cost_micros(one),
            1,
            "0.15 of a micro-unit is charged as one"
        );
        let overstated = Usage {
            input_tokens: 10,
            cached_input_tokens: 50,
            output_tokens: 0,
        };
        assert_eq!(
            PRICE.cost_micros(overstated),
            1,
            "cached tokens are capped at the prompt"
        );
    }

    #[test]
    fn the_table_round_trips_through_its_header_and_refuses_anything_else() {
        let table = Prices {
            currency: "USD".into(),
            models: BTreeMap::from([("llama-3.1-8b".to_owned(), PRICE)]),
            default: Some(Price {
                input: 1.0,
                cached_input: None,
                output: 2.0,
            }),
        };
        let header = table.to_header();
        assert_eq!(header, "USD:*=1,1,2;llama-3.1-8b=0.15,0.075,0.6");
        let parsed = Prices::parse_header(&header);
        assert_eq!(
            parsed.as_ref().and_then(|p| p.of("llama-3.1-8b")),
            Some(&PRICE)
        );
        let default = parsed
            .as_ref()
            .and_then(|p| p.of("other"))
            .map(|p| p.cached_input());
        assert_eq!(
            default,
            Some(1.0),
            "an unlisted model is priced at the default"
        );
        for bad in [
            "USD:m=0.15,0.075",
            "USD:m=0.15,0.075,0.6,1",
            "US D:m=1,1,1",
            ":m=1,1,1",
            "USD:m=-1,1,1",
            "USD:m=NaN,1,1",
            "USD:m=inf,1,1",
            "USD:m=1,1,2000000",
            "USD:m=1,1,1;m=1,1,1",
            "USD:*=1,1,1;*=2,2,2",
            "USD:1,1,1",
            "USD",
        ] {
            assert_eq!(Prices::parse_header(bad), None, "{bad}");
        }
    }
}
